"""Entry point: ``python -m train [hydra overrides]``: train, then evaluate (the entry layer joins the two)."""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from distill.environment import check_run_dir_override, one_line_errors
from eval.run import evaluate_saved
from train.config import load_config, register_configs
from train.run import run_training

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
@one_line_errors
def main(cfg: DictConfig) -> None:
    run_training(load_config(cfg), HydraConfig.get().runtime.output_dir, evaluate=evaluate_saved)


if __name__ == "__main__":
    check_run_dir_override()
    main()
