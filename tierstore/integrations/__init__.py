"""Adapters for the training frameworks tierstore's users already run.

Each adapter is a module of its own, imported by name (``tierstore.integrations.torchtitan``): this
package imports no framework, so ``import tierstore`` never loads one.
"""
