"""Persistence of tables: save / save_delta / load, export / import_, group checkpoints.

The file format and its reader live in :mod:`embstore.checkpoint` (pure numpy, no C++);
this package drives the C++ core's snapshots (``_core.begin_snapshot``: a point-in-time
copy, streamed shard by shard in bounded chunks while other threads keep training) and
imports (``import_rows``). It works on a table's internals
(:class:`embstore._internals.TableInternals`), never on the facade. Specification:
``docs/checkpoint.md``.

- :mod:`.header`: a header's table entry <-> :class:`~embstore.TableSpec`;
- :mod:`.save`: snapshot streaming, ``save``, ``save_group``;
- :mod:`.chain`, :mod:`.read`, :mod:`.load`: opening and selecting a chain, reading row
  groups on a thread, ``load``, ``load_group``;
- :mod:`.exchange`: ``export`` / ``import_``;
- :mod:`.buffers`: the chunk buffers they share.
"""
