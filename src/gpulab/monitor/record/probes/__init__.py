"""The probes: one module per recorded concern, each installing and removing its own hooks and
patches and writing only through the sink (record/sink.py). recorder.py lists them, in the order
they are installed; docs/architecture.md says what each records.
"""
