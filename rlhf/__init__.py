"""rlhf: SFT, reward-model training and PPO on one PyTorch-native hybrid engine."""

__version__ = "0.1.0"
