"""Planning a run without GPUs: exact static memory of chosen ranks (:mod:`.static_memory`, on a
:mod:`.fake_context`), the ``meshtron plan`` command (:mod:`.cli`), and the record of measured GPU
runs that the memory model is checked against (:mod:`.measured`, ``benchmarks/measured.jsonl``)."""
