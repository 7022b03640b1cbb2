"""An existing workdir's own config (its config.json) as a recipe, so that --config.* overrides
apply to it: train an imported or finished workdir further, or change its logging, without
repeating the sizes and vocabulary it was made with.

  electra-jax --config=configs/workdir.py:workdirs/continued --workdir=workdirs/continued \
      --config.train.steps=2000

The text after ':' is the workdir whose config.json is read (a gs:// workdir too).
"""

from electra_jax import config_lib


def get_config(workdir=None):
  if not workdir:
    raise config_lib.ConfigError(
        "configs/workdir.py needs the workdir to read, after a colon: "
        "--config=configs/workdir.py:DIR."
    )
  return config_lib.load_workdir_config(workdir)
