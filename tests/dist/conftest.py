import pytest


@pytest.fixture(scope="session")
def dist_workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("dist")
