"""Prompts for online RL (objective ``grpo``): records whose prompt the policy completes
and whose other fields the rewards read; and the built-in verifiable task."""
