from setuptools import find_packages, setup

setup(
    name="k3-train",
    version="0.1.0",
    description="Megatron-style multi-node training system for K3-class models",
    python_requires=">=3.11",
    packages=find_packages(include=["model*", "parallel*", "train*", "data_pipeline*", "slurm*",
                                    "configs*"]),
    include_package_data=True,
    package_data={"configs": ["**/*.yaml"], "data_pipeline": ["sample/**/*"],
                  "model": ["ops/cpu/*.c"]},
    install_requires=[
        "torch>=2.6",
        "numpy",
        "megatron-core>=0.16,<0.17; python_version<'3.12'",
        "megatron-core>=0.16; python_version>='3.12'",
        "hydra-core>=1.3",
        "hydra-submitit-launcher>=1.2",
        "wandb>=0.19",
        "datatrove>=0.4",
        # datatrove's text utilities, which its Gopher filters and MinHash stages import, need
        # regex (in datatrove's "processing" extra, whose other packages are not used here)
        "regex",
        "pyarrow>=14",
        "xxhash",
        "tokenizers>=0.19",
        # chat templates (data_pipeline.chat) are untrusted code; 3.1.6 fixes sandbox escapes
        "jinja2>=3.1.6",
        "pillow>=10",
        "safetensors>=0.4",
        "deepspeed>=0.15",
        "matplotlib>=3.8",
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "ruff>=0.6",
                "torchao>=0.10", "gfloat>=0.4", "import-linter>=2.0",
                # test_chat.py checks data_pipeline.chat against apply_chat_template; 5.25 is the
                # version tested, and it accepts the tokenizers 0.23 / huggingface_hub 2.4 /
                # safetensors 0.8 installed beside it without changing them
                "transformers>=5.25,<6",
                # test_decode.py holds the KDA decode state to fla's naive recurrence (a pure
                # torch file of fla-core, loaded without the package's triton kernels)
                "fla-core>=0.4"],
        "gpu": ["transformer-engine[pytorch]>=2.0", "fla-core>=0.4"],
    },
    entry_points={
        "console_scripts": [
            "k3-train=train.cli:train_main",
            "k3-plan=train.sizing:main",
            "k3-data=data_pipeline.cli:main",
            "k3-submit=slurm.submit:main",
            "k3-export=train.export:main",
            "k3-generate=train.generate_cli:main",
        ]
    },
)
