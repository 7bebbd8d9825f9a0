"""The app's widgets, one class a module."""
