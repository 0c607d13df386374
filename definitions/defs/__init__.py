"""The Component half of the example location: ``defs.yaml`` files (and a Python module) that
``dg.load_from_defs_folder`` loads, merged into ``definitions.defs`` beside the Pythonic half."""
