"""The ``gem`` command line."""
