-- Run once by the postgres image when the pgdata volume is created (docker-compose.yml mounts this folder
-- on /docker-entrypoint-initdb.d), as POSTGRES_USER, after it created POSTGRES_DB (mlflow: MLflow's runs).
-- The second database holds the Optuna studies (COWTUNE_OPTUNA_STORAGE, the optuna-dashboard service).
CREATE DATABASE optuna;
