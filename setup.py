from setuptools import find_packages, setup

setup(
    name="rlpo_mega",
    version="0.1.0",
    description="RL post-training of Mixture-of-Experts LLMs on Megatron-Core, provable on a laptop",
    python_requires=">=3.10",
    packages=find_packages(include=["rlpo_mega", "rlpo_mega.*", "moe", "moe.*"]),
    install_requires=[
        # This machine: torch 2.13.0 CPU (the Makefile installs it first so nothing pulls a CUDA
        # build). Clusters: any CUDA build >= 2.6 already in the environment satisfies this.
        "torch>=2.6",
        "megatron-core==0.16.1",  # newest for Python 3.11; has RouterReplay
        "transformers==5.19.0",  # the version sglang 0.5.23 pins
        "safetensors>=0.4",
        "tqdm>=4.60",  # megatron static inference engine
        "psutil>=5.9",  # megatron dist_checkpointing
        "wandb>=0.19",
        "omegaconf>=2.3",  # typed configs + dotted overrides
        "matplotlib>=3.7",  # `rlpo-mega plot` learning curves
        "xxhash>=3.0",  # weight-sync digests on the CPU (XXH3-128)
        "math-verify>=0.9,<0.10",  # math reward; pure Python (sympy, latex2sympy2_extended, antlr4 runtime)
        "numpy",
        # the SGLang client's answer decoding (rollout/sglang_client.py; the stdlib is the fallback): SGLang's own
        # dependencies, pure wheels
        "orjson>=3.9",
        "pybase64>=1.3",
    ],
    extras_require={
        # pyarrow: the Parquet prompt-file tests run; pytest-xdist: `make test` runs two workers (tests/conftest.py);
        # peft: tests/test_lora.py loads `rlpo-mega export --peft-out`'s adapter with it
        "test": ["pytest>=8", "pytest-timeout>=2.3", "pyarrow>=15", "pytest-xdist>=3.8", "peft>=0.21.2"],
        "sglang": ["sglang==0.5.23"],
        "parquet": ["pyarrow>=15"],  # Parquet prompt files (JSONL needs nothing)
        # Optional GPU accelerations (never required). apex has no usable PyPI wheel: build it from
        # https://github.com/NVIDIA/apex if you want its fused kernels.
        # Transformer Engine: the range megatron-core 0.16.1 is tested with (megatron_core-0.16.1.dist-info/METADATA:43,
        # moe.model.TE_REQUIREMENT); outside it megatron may not take TE as present (moe.model.have_transformer_engine).
        # Its torch binding must match the installed torch and CUDA.
        "gpu": ["transformer-engine[pytorch]>=2.9,<2.12"],
    },
    entry_points={"console_scripts": ["rlpo-mega=rlpo_mega.cli:entry"]},
)
