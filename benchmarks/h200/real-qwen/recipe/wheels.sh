# Here, not on the H200: the wheels server_spec.py, bench.py and the GGUF loader need there (Python 3.12), beside
# what its image already holds (anyio, h11, httpx, idna, click, prometheus_client). fastapi 0.165 needs
# opentelemetry-api; openai 3.60 needs httpx2, httpcore2 and truststore. Run from the repository root.
set -e
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.55.0 openai==3.60.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 annotated-doc==0.0.7 \
  gguf==0.19.0 typing_extensions==4.16.0 opentelemetry-api==1.45.2 importlib_metadata==10.2.0 zipp==4.1.2 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
ls .whl | wc -l
