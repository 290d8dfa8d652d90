"""Entry point: ``python -m eval drafter_path=<dir>`` (a trained drafter) or ``python -m eval drafter=lookup``."""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from distill.environment import check_run_dir_override, one_line_errors
from eval.run import run_eval
from train.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
@one_line_errors
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    # The command line decides which of a saved drafter's own settings give way (eval.saved).
    run_eval(cfg, hydra_cfg.runtime.output_dir, overrides=list(hydra_cfg.overrides.task))


# Evaluating a trained run's drafter into its run dir (the command training prints) keeps the run's own .hydra/
# record of how it was trained; the evaluation's config goes beside it.
EVAL_CONFIG_RECORD = ".hydra/eval"

if __name__ == "__main__":
    check_run_dir_override(output_subdir=EVAL_CONFIG_RECORD)
    main()
