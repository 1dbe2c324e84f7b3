# The image every pod of launch/k8s.py's TFJob runs: `python launch/train.py`
# from /app, the repository. CPU by default; GPU workers need the CUDA
# libraries: docker build --build-arg PIP_EXTRAS=gpu -t IMAGE .
FROM python:3.11-slim

# Progress lines reach `kubectl logs` as they are printed; TensorFlow's C++
# INFO lines stay out.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TF_CPP_MIN_LOG_LEVEL=2

WORKDIR /app

# The package first, so that changes to launch/ or tests/ reuse the
# installed dependencies' layer.
COPY setup.py pyproject.toml ./
COPY tf_distbelief ./tf_distbelief
ARG PIP_EXTRAS=
RUN pip install ".${PIP_EXTRAS:+[$PIP_EXTRAS]}"

# The launch scripts (the demo models' data ship with scikit-learn or are
# generated: nothing is downloaded at run time).
COPY . .

# The TFJob operator's default task port (`tfjob-port`).
EXPOSE 2222
CMD ["python", "launch/train.py"]
