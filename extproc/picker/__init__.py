"""The endpoint-picker front: the Gateway API Inference Extension's ext_proc exchange around the brain's
one decide/release (DESIGN "Fronts, sources and shared state"). It knows the wire; it never chooses."""

from .front import EndpointPicker, PickResult
from .messages import header_value, headers_of

__all__ = ["EndpointPicker", "PickResult", "header_value", "headers_of"]
