"""deep_ep.buffer, served by moeep (see deep_ep.__doc__)."""

from moeep import Buffer  # noqa: F401
