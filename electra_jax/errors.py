"""The errors a user can act on: the CLI prints them in one line, without a traceback."""


class ConfigError(ValueError):
  """A problem with the user's config, data or workdir: the message names the value and the fix."""


class DamagedCheckpoint(ConfigError):
  """A checkpoint step whose files cannot be read or whose arrays are not those saved."""


class WorkdirInUse(ConfigError):
  """Another run holds the workdir, or took it over from this one."""


class OutOfSpace(ConfigError):
  """A write refused for want of space: a full disk or quota, or a file-size limit (ulimit -f);
  `errno` is the refusal's (ENOSPC, EDQUOT, EFBIG)."""

  def __init__(self, message: str, errno: int):
    super().__init__(message)
    self.errno = errno


class CheckpointRotated(WorkdirInUse):
  """A checkpoint step removed while it was read: a live run saved a newer one and rotated it."""
