"""Reinforcement learning: rollouts, rewards, the GRPO loss and step, the adaptive memory."""
