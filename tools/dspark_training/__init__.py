"""Offline training of the tiny DSpark test checkpoints; not part of the installed package.

Run from the repository root with ``tools`` on the path (never the root itself: its
``kernels/`` folder would shadow the PyPI package ``kernels`` that SGLang imports)::

    PYTHONPATH=tools python -m dspark_training.train_target --base DIR --out DIR ...
    PYTHONPATH=tools python -m dspark_training.distill --target DIR --draft DIR --out DIR ...

``train_target`` trains a predictable word-chain target, ``distill`` distils a draft against a
target and measures it; ``llama_target`` (transformers' ``LlamaForCausalLM``) / ``m3_target``
(pure torch) are the batched targets they run, ``anchors`` the batched draft forward at every
anchor. The tests import them through pytest's ``pythonpath = ["tools"]`` (pyproject.toml).
"""
