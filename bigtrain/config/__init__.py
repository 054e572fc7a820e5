"""The typed run config: its sections (`run_config`, `sections`, `objective`; fields documented with
`bigtrain.fields`), YAML and `--set` loading (`load`), named presets (`presets`) and the cross-field rules (`rules`).

`from bigtrain.config import RunConfig` is the short way in; nothing here imports DeepSpeed.
"""
from bigtrain.config.run_config import (ActivationCheckpointConfig, BatchConfig, CheckpointConfig, DataConfig,
                                        LoggingConfig, ModelConfig, OffloadConfig, OptimizerConfig, PipelineConfig,
                                        RunConfig, ScheduleConfig, TrainConfig, ZeroConfig)

__all__ = ["ActivationCheckpointConfig", "BatchConfig", "CheckpointConfig", "DataConfig", "LoggingConfig",
           "ModelConfig", "OffloadConfig", "OptimizerConfig", "PipelineConfig", "RunConfig", "ScheduleConfig",
           "TrainConfig", "ZeroConfig"]
