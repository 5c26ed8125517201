"""Builds the cffi extension cpumla.native._cpumla with one object per instruction set.

setuptools compiles only cffi's generated wrapper; every kernel-library file under cpumla/native/csrc/
is compiled first with its own flags from cpumla/native/csrc/FLAGS (see cpumla/native/build.py) and
linked in; every file under csrc/ is a dependency of the extension.
"""

import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent / "cpumla" / "native"))


class BuildWithISAObjects(build_ext):
    def build_extension(self, ext):
        import build as native_build  # cpumla/native/build.py

        objs = native_build.compile_objects(Path(self.build_temp) / "cpumla-native")
        ext.extra_objects = list(ext.extra_objects or []) + objs
        ext.depends = list(ext.depends or []) + [str(p) for p in native_build.source_files()]
        super().build_extension(ext)


setup(
    cffi_modules=["cpumla/native/build.py:ffibuilder"],
    cmdclass={"build_ext": BuildWithISAObjects},
)
