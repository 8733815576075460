"""What every schedule shares, and the one-stage schedules: the instruction vocabulary
(``instructions``), one rank's lists on one stage (``one_stage``), every schedule by name
(``registry``), the round policy (``policy``) and the replay that checks every rank's list
(``simulate``). Plain data: no torch. The folded pipeline's fold and schedules are the plain half
of ``ds_dhelix.pipe`` (``pipe.folding``, ``pipe.schedule``), on this package's floor; the registry
lists them.
"""
