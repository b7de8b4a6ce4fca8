// umt dashboard: live updates by polling. Without JavaScript every page still works (reload it).
// Each element with data-live="URL" is refreshed from URL (server-rendered, escaped HTML)
// every 2 seconds while the tab is visible; the element's data-live attribute may go away
// (a run that finished) and polling stops.
(function () {
  "use strict";
  var PERIOD = 2000;

  function refresh(element) {
    var url = element.getAttribute("data-live");
    if (!url || document.hidden) {
      return;
    }
    fetch(url, { headers: { "Accept": "text/html" }, credentials: "same-origin" })
      .then(function (response) {
        if (!response.ok) {
          throw new Error("HTTP " + response.status);
        }
        return response.text();
      })
      .then(function (html) {
        element.innerHTML = html;
        element.setAttribute("data-updated", new Date().toISOString());
        var status = element.querySelector("[data-finished]");
        if (status) {
          element.removeAttribute("data-live");
        }
      })
      .catch(function () {
        element.setAttribute("data-stale", "true");
      });
  }

  function start() {
    var elements = document.querySelectorAll("[data-live]");
    elements.forEach(function (element) {
      window.setInterval(function () { refresh(element); }, PERIOD);
    });
    document.querySelectorAll("form[data-confirm]").forEach(function (form) {
      form.addEventListener("submit", function (event) {
        if (!window.confirm(form.getAttribute("data-confirm"))) {
          event.preventDefault();
        }
      });
    });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
