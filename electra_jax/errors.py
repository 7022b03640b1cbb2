"""The package's one user-facing error type."""


class ConfigError(ValueError):
  """A problem with the user's config, data or workdir: the message names the value and the fix,
  and the CLI prints it without a traceback."""
