"""The parts of ``passes/structured_zeros.py`` (RemoveStructuredZeros): ``leaves`` (constant weights and the
linear leaves ``x @ W (+ b)``), ``chain`` (the values computing a consumer's input along its last axis: the
analysis of Cases 1 and 2 and their narrowing; its shape and bound tensors are evaluated by the passes' one
evaluator, ``passes/_shapes.SymbolicShapes``), ``rewrite`` (the narrowed weights and the few new nodes) and
``cases`` (one function per case of the pass).
"""
