"""First-party plugins shipped with tokenmill, one subpackage per family.

Each registers through the ``tokenmill`` entry point group exactly as a
third-party plugin would, so any of them could move to its own distribution.
"""
