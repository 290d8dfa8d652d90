"""Entry point: ``python -m train [hydra overrides]``."""

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from train.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from train.run import run_training

    run_training(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    main()
