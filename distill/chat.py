"""Conversations: normalising chat records, rendering them, and masking the assistant tokens.

Records arrive as ShareGPT ``conversations`` (``from``/``value``) or OpenAI
``messages`` (``role``/``content``); both become ``[{"role", "content"}]``.
A conversation is rendered with the tokenizer's chat template or, for
tokenizers without one (e.g. the toy target), as plain "role: content" lines.

How the assistant masks are computed. The conversation is rendered prefix by
prefix. A reply's character span starts where the conversation-so-far plus the
generation prompt (the assistant header) ends and stops where the conversation
including that reply ends, so it covers the reply and the template's
end-of-turn marker but no header. Templates whose renderings are not prefixes
of one another (some rewrite earlier turns) fall back to locating the reply's
content text. The rendered text is then tokenised with character offsets, and a
token is an assistant token when its character range overlaps one of the
spans: overlap (rather than containment) keeps a token that straddles a
boundary, such as " Hello" with its leading space taken from the header, and
zero-width offsets are widened to one character so they are not lost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from distill.bounded import tokenise

log = logging.getLogger(__name__)

VALID_CHAT_TEMPLATES = ("auto", "none")

# ShareGPT speaker names -> OpenAI roles. "user"/"assistant" appear in some
# ShareGPT dumps too, so they are accepted as-is.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
MESSAGE_ROLES = ("system", "user", "assistant", "tool")

# The plain rendering for tokenizers without a chat template (e.g. the toy target).
# The generation prompt has no trailing space so that, like in training text, the
# first reply token carries its own leading space ("assistant:" + " Hello").
PLAIN_TURN = "{role}: {content}\n"
PLAIN_GENERATION_PROMPT = "assistant:"

Messages = list[dict[str, str]]
# One encoded example: token ids and the aligned loss mask (also what distill.data packs).
Example = tuple[list[int], list[bool]]


def normalize_messages(record: Mapping, index: int) -> Messages:
    """ShareGPT ``conversations`` or OpenAI ``messages`` -> ``[{"role", "content"}]``."""
    if "conversations" in record:
        turns, role_key, content_key, roles = record["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        turns, role_key, content_key = record["messages"], "role", "content"
        roles = {r: r for r in MESSAGE_ROLES}
    if not isinstance(turns, Sequence) or isinstance(turns, str):
        raise ValueError(f"data: record {index} conversation is a {type(turns).__name__}, expected a list of turns")
    messages = []
    for turn_index, turn in enumerate(turns):
        if not isinstance(turn, Mapping):
            raise ValueError(
                f"data: record {index} turn {turn_index} is a {type(turn).__name__} ({str(turn)[:40]!r}), expected an "
                f"object like {{{role_key!r}: ..., {content_key!r}: ...}}; fix the record or drop it"
            )
        role = turn.get(role_key)
        if role not in roles:
            raise ValueError(
                f"data: record {index} turn {turn_index} has unknown role {role!r}; "
                f"valid {role_key!r} values are {sorted(roles)}"
            )
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise ValueError(
                f"data: record {index} turn {turn_index} {content_key!r} is {type(content).__name__}, "
                "expected a string"
            )
        messages.append({"role": roles[role], "content": content})
    return messages


def render_plain(messages: Messages, add_generation_prompt: bool = False) -> str:
    """"role: content" lines, for tokenizers without a chat template."""
    text = "".join(PLAIN_TURN.format(**m) for m in messages)
    return text + PLAIN_GENERATION_PROMPT if add_generation_prompt else text


_warned_plain: list[bool] = []  # the fallback to the plain template is said once per process


def chat_renderer(tokenizer, chat_template: str, chat_rows: bool = True) -> Callable[[Messages, bool], str]:
    """The function turning messages into text: the tokenizer's template, or the plain one. ``chat_rows``: chat
    records will be rendered (a plain fallback under ``auto`` is then warned about, once)."""
    if chat_template not in VALID_CHAT_TEMPLATES:
        raise ValueError(f"data.chat_template: {chat_template!r} is not one of {VALID_CHAT_TEMPLATES}")
    if chat_template == "auto" and getattr(tokenizer, "chat_template", None):

        def render(messages: Messages, add_generation_prompt: bool = False) -> str:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )

        return render
    if chat_template == "auto" and chat_rows and not _warned_plain:
        _warned_plain.append(True)
        log.warning("data.chat_template=auto: the tokenizer has no chat template, so conversations are rendered as "
                    "plain 'role: content' lines, a format the target was not trained on; use a tokenizer with a chat "
                    "template (the target's instruct variant), or set data.chat_template=none to choose the plain "
                    "format and silence this warning")
    return render_plain


def assistant_char_spans(messages: Messages, render: Callable[[Messages, bool], str]) -> tuple[str, list]:
    """The rendered conversation and the character span of each assistant reply in it; see the module docstring."""
    full = render(messages, False)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], False) if i else ""
        with_prompt = render(messages[:i], True)
        upto = render(messages[: i + 1], False)
        if not full.startswith(upto):
            spans.append(_find_content(full, message["content"], cursor))
        else:
            start = len(with_prompt) if upto.startswith(with_prompt) else len(before)
            spans.append((start, len(upto)))
        cursor = spans[-1][1]
    return full, spans


def _find_content(full: str, content: str, cursor: int) -> tuple[int, int]:
    start = full.find(content, cursor)
    if start < 0:
        raise ValueError(
            "data.chat_template: the tokenizer's chat template drops or rewrites assistant replies, so "
            "assistant tokens cannot be located; set data.chat_template=none or data.assistant_only_loss=false"
        )
    return start, start + len(content)


def spans_to_token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """True for each token whose character range overlaps one of ``spans``; see the module docstring."""
    mask = []
    for start, end in offsets:
        end = max(end, start + 1)
        mask.append(any(start < s_end and end > s_start for s_start, s_end in spans))
    return mask


def encode_chat(tokenizer, messages: Messages, render, assistant_only: bool, prefix: list[int],
                max_tokens: int | None = None) -> Example:
    """Token ids of a rendered conversation and its loss mask (assistant tokens only, or all); with ``max_tokens``,
    the first ``max_tokens`` only, the rest never tokenised (``distill.bounded``)."""
    if assistant_only:
        text, spans = assistant_char_spans(messages, render)
        offsets, ids = _encode_with_offsets(tokenizer, text, max_tokens)
        mask = spans_to_token_mask(offsets, spans)
    else:
        ids = tokenise(tokenizer, render(messages, False), max_tokens)[0]
        mask = [True] * len(ids)
    if render is render_plain and prefix:
        # A chat template writes its own BOS; the plain rendering needs the tokenizer's.
        ids, mask = prefix + ids, [False] * len(prefix) + mask
    return ids, mask


def _encode_with_offsets(tokenizer, text: str, max_tokens: int | None = None) -> tuple[list, list[int]]:
    try:
        ids, offsets = tokenise(tokenizer, text, max_tokens, offsets=True)
    except NotImplementedError as exc:  # Python (non-Rust) tokenizers have no offsets
        raise ValueError(
            f"data.assistant_only_loss: locating assistant tokens needs a fast tokenizer with offsets, "
            f"got {type(tokenizer).__name__}; load a fast tokenizer or set data.assistant_only_loss=false"
        ) from exc
    return offsets, ids
