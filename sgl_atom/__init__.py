"""sgl_atom: ATOM's serving features for SGLang 0.5.23, loaded as an SGLang plugin.

Importing this package is cheap and touches nothing in SGLang; SGLang calls
:func:`sgl_atom.plugin.register` through the ``sglang.srt.plugins`` entry point.
"""

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.23"
