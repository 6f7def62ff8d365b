"""Build and install shmserve: the packages `shmserve` and `workers`, the C extension, the CLI."""

from setuptools import Extension, find_packages, setup

setup(
    name="shmserve",
    version="0.1.0",
    description="Single-host inference serving over POSIX shared memory",
    python_requires=">=3.11",
    packages=find_packages(include=["shmserve", "shmserve.*", "workers", "workers.*"]),  # every subpackage
    package_data={"shmserve.models": ["demo.onnx"]},
    ext_modules=[
        Extension(
            name,
            sources=[f"shmserve/{name.rpartition('.')[2]}.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Werror=implicit-function-declaration"],
        )
        # _atomics: the word-level operations; _hotpath: the lane round trip (shmserve/hotpath.py)
        for name in ("shmserve._atomics", "shmserve._hotpath")
    ],
    install_requires=[
        "posix_ipc>=1.1,<2",
        "numpy>=1.24,<3",
        "ml_dtypes>=0.3,<1",  # bfloat16 for numpy (numpy has none)
        "uvloop>=0.19,<1",
        "orjson>=3.9,<4",
        "onnxruntime>=1.17,<2",  # the embedded demo model runs on it
        "prometheus_client>=0.17,<1",
        "rich>=13,<16",
        "httptools>=0.6,<1",  # the KServe v2 HTTP door's parser (serve --http)
    ],
    extras_require={
        "plot": ["matplotlib>=3.7,<4"],  # shmserve bench --plot
        "test": ["pytest>=8,<10", "hypothesis>=6.100,<7", "onnx>=1.15,<2", "matplotlib>=3.7,<4",
                 # the v2 front door is tested with Triton's own clients (and serves gRPC in the tests)
                 "tritonclient[http,grpc]>=2.73,<2.74", "grpcio>=1.60,<2",
                 # a hostile HTTP/2 peer for the gRPC door's bounds (frames a gRPC client never sends)
                 "h2>=4.1,<5",
                 # deploy/kserve/ checked offline (tests/test_scale_out.py): Kubernetes' published schemas
                 "kubernetes-validate>=1.33,<2", "jsonschema>=4.23,<5", "referencing>=0.35,<1", "PyYAML>=6,<7",
                 # the TensorRT lean runtime: import, runtime creation and error paths run without a GPU
                 "tensorrt-lean-cu13>=11,<12; platform_machine == 'x86_64'",
                 # the model zoo (tests/test_zoo.py) builds a small BERT encoder from its config, offline
                 "transformers>=4.50,<6"],
        "gpu": ["cuda-python>=12.4,<14"],
        # the KServe v2 doors (serve --http/--grpc) and Triton's clients to call them: grpcio, and
        # Triton's generated GRPCInferenceService (shipped in tritonclient); pip install -e '.[v2]'
        "v2": ["grpcio>=1.60,<2", "tritonclient[http,grpc]>=2.50,<3"],
        "grpc": ["grpcio>=1.60,<2", "tritonclient[http,grpc]>=2.50,<3"],  # the v2 extra's former name
        "onnx": ["onnx>=1.15,<2"],  # to rebuild the demo model (tools/make_demo_model.py)
        "torch": ["torch>=2.3,<3"],
        "tensorrt": ["tensorrt>=10,<12"],
    },
    entry_points={"console_scripts": ["shmserve=shmserve.cli:main"]},
)
