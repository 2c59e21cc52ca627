"""The only subpackage that imports torch: wings with a face each (``save``, ``restore``, ``staging``,
``mirror``, ``tools``), the data layout and collectives; users import from :mod:`tierstore`."""
