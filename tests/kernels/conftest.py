"""Every kernel test runs with each kernel output filled with NaN before its launch, so that an
element a kernel fails to write cannot pass as a plausible value."""

import pytest

from lit_mhar.kernels.launch import poison_outputs


@pytest.fixture(autouse=True)
def poisoned():
    with poison_outputs():
        yield
