"""Old home of the adapters to other libraries: see :mod:`fastattn.integrations`."""
