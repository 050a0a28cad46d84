"""The names of the policy-loss methods of :func:`trainer.corrections.policy_loss` and their
default MIS band, importable without torch (for command lines and configs)."""

METHODS = ("grpo", "grpo-mis", "sc", "sc-mis", "sc-mis-topp")
DEFAULT_BAND = (0.5, 5.0)
