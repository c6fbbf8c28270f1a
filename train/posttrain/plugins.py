"""A user's own judge or tool environment, named "package.module:attribute" in a config."""

from __future__ import annotations

import importlib
import inspect

from model.errors import ConfigError


def load_plugin(spec: str, what: str, *args) -> object:
    """The object `spec` names, made: a class, or a function that can be called with `args`
    (none by default: a factory), is called with them and its result returned; any other
    attribute is returned as it is. `what` names the plugin in errors ("judge", "environment").

    Raises ConfigError naming the spec when it is malformed, its module does not import, the
    attribute is missing, or calling it fails (a class that needs arguments included).
    """
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute or ":" in attribute:
        raise ConfigError(f"{what} {spec!r} is invalid: must be 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{what} {spec!r}: module {module_name} does not import ({e})") from e
    try:
        found = getattr(module, attribute)
    except AttributeError as e:
        raise ConfigError(f"{what} {spec!r}: module {module_name} has no attribute "
                          f"{attribute!r}") from e
    if not (inspect.isclass(found) or _callable_with(found, args)):
        return found
    try:
        return found(*args)
    except Exception as e:
        raise ConfigError(f"{what} {spec!r}: calling {attribute}() failed: "
                          f"{type(e).__name__}: {e}") from e


def _callable_with(found: object, args: tuple) -> bool:
    if not callable(found):
        return False
    try:
        inspect.signature(found).bind(*args)
    except (TypeError, ValueError):  # ValueError: a builtin without a signature
        return False
    return True
