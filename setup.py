"""The one compiled part of recstack: host loops of the eb codec (recstack/compression/eb/_ebkernels.c,
bound to Python by _ebhost.c).

Optional: without a C compiler the build goes on and recstack uses the numpy versions of the same loops
(same messages, slower). No FMA contraction, so that the C loops round exactly like numpy's float32 code.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "recstack.compression.eb._ebhost",
            ["recstack/compression/eb/_ebhost.c", "recstack/compression/eb/_ebkernels.c"],
            depends=["recstack/compression/eb/_ebkernels.h"],
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"],
            optional=True,
        )
    ]
)
