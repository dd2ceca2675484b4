"""``dflash-mlx bench``: the autoregressive baseline and DFlash side by side.

For every prompt and repeat the same loaded target runs mlx-lm's own
``stream_generate`` (the baseline) and each DFlash arm (``schedule.Arm``: the
chain at each ``--block-size``, a DDTree of each ``--tree-budget``), back to
back, in an order that alternates between consecutive units (``schedule``),
after an untimed warm-up. Every run is timed the same way from outside the
generator (``runs``): prefill is the time to the first token; decode is the
time from the first token to the last, over the tokens after the first.
Speedup is the ratio of decode speeds of one baseline run and the DFlash run
next to it; at temperature 0 the DFlash tokens must equal the baseline's
(``summary``). The report keeps every raw figure, the machine and the exact
configuration (``report``); ``render`` prints and plots it.

``--predict`` runs nothing: ``cost_model`` prices each forward pass in bytes and
FLOPs on the ``chips`` (a tree's verify over its B+1 positions), for a local
pair or the ``presets`` (``predict``).
``--concurrency N,...`` runs waves of N requests at once, mlx-lm's batched
decoding beside our batch decoder (``concurrency``; its tables and JSON:
``concurrency_report``); with ``--predict`` it prices N rows per pass
(``batch_cost``).
``command`` holds the command's argument handling.
"""
