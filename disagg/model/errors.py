"""Errors of `disagg.model`: a bad model directory, weights file, preset or chat template.

All derive from `disagg.errors.DisaggError` (through `ModelError`) and from `ValueError`, so a
caller can catch the project's errors apart from bugs. Messages name the file and, for weights,
the tensor. Raised while loading (in the process that loads the model), never on the forward path.
"""

from __future__ import annotations

from disagg.errors import DisaggError


class ModelError(DisaggError, ValueError):
    """Base class of the model package's errors."""


class ModelConfigError(ModelError):
    """config.json is missing, unreadable, or holds a value the model does not support."""


class UnsupportedArchitecture(ModelConfigError):
    """config.json names an architecture (or rope type, activation, ...) this model cannot run."""


class WeightsError(ModelError):
    """A weights file is missing or unreadable, or a tensor is missing, unexpected or misshaped."""


class ChatTemplateError(ModelError):
    """The model directory has no chat template, or the template failed to render."""
