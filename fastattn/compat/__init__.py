"""Adapters with other libraries' argument orders and conventions."""
