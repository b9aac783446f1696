"""Built-in gemcore plugins. Each module is registered through the ``gemcore.plugins`` entry-point
group in pyproject.toml, exactly like a third-party plugin."""
