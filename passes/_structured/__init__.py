"""The parts of ``passes/structured_zeros.py`` (RemoveStructuredZeros): ``leaves`` (constant weights and the
linear leaves ``x @ W (+ b)``), ``ints`` (the small integer evaluator of shape and bound tensors), ``chain`` (the
values computing a consumer's input along its last axis: the analysis of Cases 1 and 2 and their narrowing),
``rewrite`` (the narrowed weights and the few new nodes) and ``cases`` (one function per case of the pass).
"""
