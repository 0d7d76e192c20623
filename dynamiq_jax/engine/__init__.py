"""The engine: what runs inside the front doors.

``options`` (the validated options a front door builds once), ``buckets``
(the bucket layout and the statistics), ``programs`` (one bucket's program:
guard, statistics, the schedule's hops, decode), ``guard`` (the non-finite
guard), ``stacked`` (the bucket loops for scanned layers) and ``moshpit``
(Moshpit's rounds). Nothing here is public API.
"""
