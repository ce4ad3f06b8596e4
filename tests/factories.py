"""The test kit's factories, under the name the tests have always imported them by.

They live in ``tokenmill.testing.factories`` so that plugin packages can use them too.
"""

from __future__ import annotations

from tokenmill.testing.factories import *  # noqa: F403
from tokenmill.testing.factories import __all__ as __all__
