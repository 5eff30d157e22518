"""The package's refusal: a setting TorchGroupedMLP cannot honour."""


class TorchExpertsConfigError(ValueError):
    """A setting that TorchGroupedMLP cannot honour; the message names the field and the fix."""
