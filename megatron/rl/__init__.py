"""Reinforcement-learning post-training: tasks and verifiable rewards (tasks.py, rewards.py); rollouts and
policy-gradient objectives follow."""
