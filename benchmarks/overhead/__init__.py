"""What GNMR costs at run time: step time against the low-cost path, the monitor against
clipping, the collectives of a step, the controller's decision, DeepSpeed's and megatron-core's
steps with GNMR on and off, and the memory the ``act_quant`` backend saves.

``python -m benchmarks.overhead`` runs parts (a)-(c) and writes ``results/overhead.json``; every
other module here is a command of its own (its docstring says which).
"""
