"""Environment errors at the entry points: one line naming the file and the fix, never a raw traceback.

A full disk, a path that is a file where a directory belongs, a directory without write permission, an output another
job is writing: these are the user's environment, not a bug, and a traceback through torch or Hydra hides the one
thing to act on; so is a refusal of a setting, which names the key, the value and the fix. ``one_line_errors`` wraps
an entry point's task function: an ``OSError``, a ``WriterLockedError``, a ``ValueError`` (this project's refusals)
or a ``FloatingPointError`` (a diverged run) leaves as ``SystemExit`` with one line, exit status 1, and a Ctrl-C
outside the training steps as one line, exit status 130 (Hydra passes ``SystemExit`` through; its own error printing
handles only ``Exception``). ``check_run_dir_override`` catches the errors Hydra would meet before any of our code runs
(a run dir that is a file or not writable) and takes the run dir's lock there, on the dir Hydra resolves.
``SPECDRAFT_TRACEBACK=1`` keeps the traceback, for a bug report.

It lives in ``distill``, the lowest layer with entry points (``python -m distill.cache``, ``distill.regenerate``).
"""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from distill.atomic import space_note
from distill.lock import NAME_MAX, WriterLockedError, claim_run_dir

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NOT_A_DIR = (errno.ENOTDIR, errno.EEXIST)
_NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)


def explain(e: OSError) -> str:
    """One line for an OS error: what happened to which file, and what to do."""
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        e = _first_copy_error(e.args[0])  # copytree gathers every file's error into one list
    where = e.filename if e.filename is not None else "?"
    if e.errno in _NO_SPACE:
        return (f"no space left writing {where} ({e.strerror}); free space (or raise the quota) on that filesystem, "
                f"then rerun the same command: a training run resumes from its last whole checkpoint, and the "
                f"unfinished one it leaves (checkpoints/.step_*.partial) is removed then")
    if e.errno in _NOT_A_DIR:
        return (f"{where} is in the way: a directory is needed there but a file holds the name ({e.strerror}); "
                f"move that file aside or choose another path")
    if e.errno in _NO_PERMISSION:
        return (f"cannot write {where} ({e.strerror}); choose a path this user may write (hydra.run.dir, "
                f"output_dir, cache.dir, regenerate.out, $SPECDRAFT_CACHE), or fix its permissions")
    if e.errno is None:  # raised by this project with its own message (which names the key and the fix)
        return str(e)
    return f"{e.strerror or e}: {where}"


def _first_copy_error(errors: list) -> OSError:
    """The first of ``shutil.copytree``'s gathered ``(source, destination, reason)`` as an OSError on the destination
    (its errno read back from the reason's ``[Errno N]``)."""
    source, destination, reason = errors[0]
    found = re.search(r"\[Errno (\d+)\]", str(reason))
    if found is None:
        return OSError(f"copying {source} to {destination} failed: {reason}")
    code = int(found.group(1))
    size = os.path.getsize(source) if os.path.isfile(source) else 0
    return OSError(code, f"{os.strerror(code)}; {space_note(destination, size)}", destination)


def one_line_errors(task: Callable) -> Callable:
    """Wrap an entry point's task function (module docstring)."""

    @functools.wraps(task)
    def wrapped(*args, **kwargs):
        if os.environ.get("SPECDRAFT_TRACEBACK") == "1":
            return task(*args, **kwargs)
        try:
            return task(*args, **kwargs)
        except KeyboardInterrupt:  # Ctrl-C outside the training steps (which stop at a checkpoint, train.preemption)
            print("interrupted (Ctrl-C); rerun the same command to continue (a training run resumes from its last "
                  "checkpoint)", file=sys.stderr)
            raise SystemExit(128 + signal.SIGINT) from None
        except (WriterLockedError, ValueError, FileExistsError) as e:  # refusals: key, value, fix
            put_back_startup_files()  # a refused command leaves the run dir as it found it
            raise SystemExit(f"error: {explain(e) if isinstance(e, OSError) else e}") from None
        except FloatingPointError as e:  # a diverged run
            raise SystemExit(f"error: {e}") from None
        except OSError as e:
            raise SystemExit(f"error: {explain(e)}") from None

    return wrapped


CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # every entry point's Hydra config


# Hydra's own flags (``python -m train --help``): those that take a value and change what is composed, and those
# after which Hydra runs no job in a run dir (it prints, or sweeps into hydra.sweep.dir instead).
_CONFIG_FLAGS = {"--config-name": "name", "-cn": "name", "--config-path": "path", "-cp": "path",
                 "--config-dir": "dir", "-cd": "dir"}
_NO_RUN_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--info", "-i", "--shell-completion",
                 "-sc", "--multirun", "-m", "--experimental-rerun"}
_RUN_FLAGS = {"--run", "-r", "--resolve"}


def _hydra_flags(argv: Sequence[str]) -> tuple[list[str], dict[str, str]] | None:
    """(the overrides, ``{"name" | "path" | "dir": value}``) of a command line whose flags start a job in a run dir;
    None for one that does not (``--help``, ``--cfg``, ``--multirun``) or a flag not known here."""
    overrides, flags, tokens = [], {}, list(argv)
    while tokens:
        token = tokens.pop(0)
        if not token.startswith("-"):
            overrides.append(token)
            continue
        flag, eq, value = token.partition("=")
        if flag in _CONFIG_FLAGS:
            if not eq:
                if not tokens:
                    return None
                value = tokens.pop(0)
            flags[_CONFIG_FLAGS[flag]] = value
        elif flag not in _RUN_FLAGS or eq:
            return None
    return overrides, flags


def _config_dir(flags: dict[str, str], main_dir: Path) -> Path:
    """The primary config dir: ``--config-path`` (absolute, or relative to the entry point's file, as Hydra reads
    it) or the project's ``conf/``."""
    if "path" not in flags:
        return CONF_DIR
    path = Path(flags["path"]).expanduser()
    return path if path.is_absolute() else (main_dir / path).resolve()


def resolved_run_dir(argv: Sequence[str], main_dir: Path | None = None) -> Path | None:
    """The run dir Hydra will use for this command line: ``hydra.run.dir`` composed as Hydra composes it (its
    interpolations, ``${oc.env:...}`` and ``${now:...}`` included, resolved; quotes stripped; ``~`` expanded), with
    the config ``--config-name`` / ``--config-path`` / ``--config-dir`` choose. None when Hydra runs no job in a run
    dir (``--help``, ``--cfg``, ``--multirun`` ...), or for a flag or an override Hydra should report in its own words.
    ``main_dir``: the entry point's directory, which a relative ``--config-path`` starts from."""
    parsed = _hydra_flags(argv)
    if parsed is None:
        return None
    overrides, flags = parsed
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

    if "dir" in flags:  # as Hydra adds --config-dir: one more place to look for configs
        overrides.append(f"hydra.searchpath=[file://{Path(flags['dir']).expanduser().absolute()}]")
    try:
        with initialize_config_dir(config_dir=str(_config_dir(flags, main_dir or CONF_DIR.parent / "train")),
                                   version_base="1.3"):
            cfg = compose(config_name=flags.get("name", "config"), overrides=overrides, return_hydra_config=True)
            value = OmegaConf.select(cfg, "hydra.run.dir")
    except InterpolationResolutionError as e:
        _refuse_unset_variable(e, argv)
        return None
    except (HydraException, OmegaConfBaseException, ValueError):
        return None
    return Path(str(value)).expanduser().absolute() if value else None


def _refuse_unset_variable(e: Exception, argv: Sequence[str]) -> None:
    """One line for a run dir that reads an environment variable which is not set (``${oc.env:TASK}`` outside the
    job that sets it), in place of Hydra's page of traceback through its resolvers."""
    found = re.search(r"Environment variable '([^']+)' not found", str(e))
    if found is None:
        return
    name = found.group(1)
    given = next((t.partition("=")[2] for t in argv if t.lstrip("+").partition("=")[0] == "hydra.run.dir"), None)
    where = f"hydra.run.dir={given}" if given else "hydra.run.dir"
    raise SystemExit(f"error: {where} reads the environment variable {name}, which is not set; set it "
                     f"(export {name}=...), or give it a default: ${{oc.env:{name},<default>}}")


def _check_writable(run_dir: Path) -> None:
    """One line, before Hydra tries: a run dir with a name longer than a file name may be, a run dir (or a parent)
    that is a file, or one that this user may not write."""
    for part in run_dir.parts:
        if len(part.encode()) > NAME_MAX:  # checked first: stat() itself raises on such a name
            raise SystemExit(f"error: hydra.run.dir={run_dir}: the name {part[:24]}... is {len(part.encode())} "
                             f"bytes, longer than the {NAME_MAX} a file name may have; choose a shorter hydra.run.dir")
    for p in (run_dir, *run_dir.parents):
        if p.exists() and not p.is_dir():
            raise SystemExit(f"error: hydra.run.dir={run_dir}: {p} is a file, not a directory; choose another "
                             f"hydra.run.dir (or move that file aside)")
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == run_dir else f"cannot be created: {existing} is not writable"
        raise SystemExit(f"error: hydra.run.dir={run_dir} {what} by this user; choose a hydra.run.dir this user may "
                         f"write (or fix its permissions)")


def _override(run_dir: Path) -> str | None:
    """``hydra.run.dir=<run_dir>`` as a Hydra override (quoted), or None for a path the quoting cannot carry."""
    text = str(run_dir)
    return None if any(c in text for c in "'\\$") else f"hydra.run.dir='{text}'"


def check_run_dir_override(argv: Sequence[str] | None = None, output_subdir: str = ".hydra") -> None:
    """Before Hydra starts: resolve the run dir as Hydra will (``resolved_run_dir``), refuse in one line a run dir
    Hydra could not write (a file in the way, no write permission), then take its writer lock
    (``distill.lock.claim_run_dir``), refusing in one line a run dir another job is writing. Called with the process's
    own command line (``argv`` None), the resolved dir is passed on to Hydra in place of the given one, so that a
    ``${now:...}`` read a second later cannot name another dir than the one locked. Only the main rank of a
    multi-process launch (``RANK`` unset or 0) locks; the others follow it (``train.run``). ``output_subdir``: where
    in the run dir Hydra records this command's config (``hydra.output_subdir``, unless the command line sets it):
    ``python -m eval`` keeps its record beside a training run's ``.hydra/``, never over it."""
    pin = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    given = [t for t in argv if t.lstrip("+").partition("=")[0] == "hydra.output_subdir"]
    if output_subdir != ".hydra" and not given:
        argv.append(f"hydra.output_subdir={output_subdir}")
        if pin:
            sys.argv.append(argv[-1])
    elif given:
        output_subdir = given[-1].partition("=")[2].strip("'\"") or ".hydra"
    if os.environ.get("RANK", "0") != "0":
        return
    main = Path(sys.argv[0]).resolve().parent if pin and sys.argv and os.path.isfile(sys.argv[0]) else None
    run_dir = resolved_run_dir(argv, main)
    if run_dir is None:
        return
    _check_writable(run_dir)
    try:
        claim_run_dir(run_dir)
    except WriterLockedError as e:
        raise SystemExit(f"error: {e}") from None
    except OSError as e:
        raise SystemExit(f"error: {explain(e)}") from None
    if pin:
        _remember_startup_files(run_dir, output_subdir)
    override = _override(run_dir)
    if pin and override is not None:
        kept = [t for t in sys.argv[1:] if t.lstrip("+").partition("=")[0] != "hydra.run.dir"]
        sys.argv[1:] = [*kept, override]


# What Hydra writes into the run dir before any of our code runs: its config record (``.hydra/``, or the
# ``hydra.output_subdir`` a command sets) and the job log (``<job>.log``).
_HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")
_startup: dict = {}


def _startup_files(run_dir: Path, subdir: str = ".hydra") -> list[Path]:
    return [*(run_dir / subdir / name for name in _HYDRA_FILES), *sorted(run_dir.glob("*.log"))]


def _remember_startup_files(run_dir: Path, subdir: str = ".hydra") -> None:
    """Record the files Hydra is about to write, as they are (bytes of its config record, a log's length; their
    times), so that ``put_back_startup_files`` can undo Hydra's writes when the command is refused."""
    files = {}
    for path in _startup_files(run_dir, subdir):
        if path.is_file():
            st = path.stat()
            kept = path.read_bytes() if path.suffix == ".yaml" else st.st_size
            files[path] = (kept, st.st_atime_ns, st.st_mtime_ns)
    created = [d for d in (run_dir / subdir, *(run_dir / subdir).parents) if d == run_dir or run_dir in d.parents]
    _startup.update(run_dir=run_dir, subdir=subdir, files=files, existed={d: d.is_dir() for d in created})


def put_back_startup_files() -> None:
    """A command refused for a run dir (another seed on resume, ``trainer.resume=never`` over an earlier run, an
    evaluation into another run's dir) leaves it as it found it: Hydra's rewrite of its config record and its job log
    lines are undone (bytes and modification times), and what it created for this command is removed."""
    if not _startup:
        return
    recorded = dict(_startup)
    _startup.clear()  # once: what was recorded is this command's run dir only
    run_dir, files = recorded["run_dir"], recorded["files"]
    for path in _startup_files(run_dir, recorded["subdir"]):
        if path not in files:
            path.unlink(missing_ok=True)
            continue
        kept, atime, mtime = files[path]
        if isinstance(kept, bytes):
            path.write_bytes(kept)
        else:
            os.truncate(path, kept)
        os.utime(path, ns=(atime, mtime))
    for directory, existed in recorded["existed"].items():  # deepest first: the subdir, then the run dir
        if not existed and directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()
