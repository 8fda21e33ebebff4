"""Install megatron-mm-balance: image-token load balancing for Megatron-LM VLM pretraining."""
from setuptools import find_packages, setup

setup(
    name="megatron-mm-balance",
    version="0.1.0",
    description=(
        "Removes vision-encoder stragglers from vision-language (and MoE) pretraining "
        "by redistributing packed sequences across data-parallel ranks."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_mm_balance", "megatron_mm_balance.*"]),
    package_data={"megatron_mm_balance": ["data/*.json", "data/*.jsonl"]},
    # torch is pinned by the installer scripts (scripts/setup_env.sh) to a CPU wheel on
    # machines without CUDA; here we only state the range we support, so that pip never
    # replaces a torch the user already has.
    # pyyaml: 'mm-balance simulate' reads its timing models from YAML (small, pure Python).
    install_requires=["numpy>=1.24", "torch>=2.4", "pyyaml>=6"],
    extras_require={
        "megatron": ["megatron-core==0.16.1"],
        "energon": ["megatron-energon"],
        "data": ["megatron-energon", "pillow", "tokenizers"],   # mm-balance make-dataset
        "gpu": ["transformer-engine", "apex"],
        "sim": ["matplotlib>=3.7"],
        "test": ["pytest>=8", "hypothesis>=6.100", "pytest-benchmark>=4", "pytest-timeout>=2.3",
                 "scipy>=1.10",   # the exact two-phase reference (solver/exact.py)
                 "matplotlib>=3.7", "pyyaml>=6"],
    },
    entry_points={"console_scripts": ["mm-balance=megatron_mm_balance.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "License :: OSI Approved :: Apache Software License",
    ],
)
