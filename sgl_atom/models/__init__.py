"""sgl_atom's model classes for SGLang; opt in with SGLANG_EXTERNAL_MODEL_PACKAGE=sgl_atom.models.

SGLang imports every module of this package and registers each module's ``EntryClass`` under
the class name, which must equal ``architectures[0]`` of the checkpoint's config.json (for the
DSpark draft: ``AtomDSparkDraftModel``). Modules here may import SGLang; nothing else in
sgl_atom imports this package.
"""
