"""Persistence of tables: save / save_delta / load, export / import_, group checkpoints.

The C++ core writes and reads checkpoint files (``_core.checkpoint_save`` /
``checkpoint_load`` and their group forms: point-in-time snapshots streamed in bounded
chunks while other threads keep training); the file format and its independent pure-numpy
reader live in :mod:`embstore.checkpoint`. This package works on a table's internals
(:class:`embstore._internals.TableInternals`), never on the facade. Specification:
``docs/checkpoint.md``.

- :mod:`.header`: a header's table entry -> :class:`~embstore.TableSpec`;
- :mod:`.save`, :mod:`.load`: ``save``, ``save_group``, ``load``, ``load_group`` (the core's);
- :mod:`.chain`, :mod:`.read`: opening a chain and reading its row groups in Python, for
  the sharded store's streamed re-routing (:mod:`embstore._sharded`);
- :mod:`.exchange`: ``export`` / ``import_``;
- :mod:`.buffers`: the chunk buffers they share.
"""
