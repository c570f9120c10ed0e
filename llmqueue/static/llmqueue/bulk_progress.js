// A bulk job's page (llmqueue/templates/llmqueue/bulk/job_detail.html): polls the job's progress
// JSON and updates the bar, the counts and the status in place until the job is finished.
(function () {
  "use strict";
  var root = document.getElementById("bulk-progress");
  if (!root || root.dataset.finished === "true") {
    return;
  }
  var every = parseInt(root.dataset.pollMs, 10) || 2000;

  function show(p) {
    var bar = root.querySelector("progress");
    bar.max = p.total || 1;
    bar.value = p.done;
    root.querySelector('[data-field="status"]').textContent = p.status;
    root.querySelector('[data-field="done"]').textContent = p.done;
    root.querySelector('[data-field="percent"]').textContent = p.percent;
    Object.keys(p.counts).forEach(function (status) {
      var cell = root.querySelector('[data-count="' + status + '"]');
      if (cell) {
        cell.textContent = p.counts[status];
      }
    });
    if (p.finished) {
      root.querySelectorAll("[data-hide-when-finished]").forEach(function (el) {
        el.hidden = true;
      });
    }
  }

  function poll() {
    fetch(root.dataset.url, { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (response) {
        if (!response.ok) {
          throw new Error("progress: HTTP " + response.status);
        }
        return response.json();
      })
      .then(function (p) {
        show(p);
        if (!p.finished) {
          window.setTimeout(poll, every);
        }
      })
      .catch(function () {
        window.setTimeout(poll, every * 2); // a restart or a blip: keep trying, more slowly
      });
  }

  window.setTimeout(poll, every);
})();
