from model.config import ModelConfig, ConfigError
